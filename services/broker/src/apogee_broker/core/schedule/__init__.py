"""The broker's side of delayed and timer messages.

- :mod:`.layout` - :class:`ScheduleLayout`: where they wait (the schedule topic's delay-level
  queues and timer wheel), and how a send turns a message into its schedule-topic copy.
- :mod:`.service` - :class:`ScheduleService`: what the schedule service calls (state, scan,
  resolve, progress).
- :mod:`.progress` - the schedule service's progress, kept in ``scheduleProgress.json``.
"""
