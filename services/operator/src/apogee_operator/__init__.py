"""Apogee operator: keeps the brokers in line with apogee.io Topic and ConsumerGroup resources."""
