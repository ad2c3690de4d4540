"""The producer: accumulator (batches), routes, fault tolerance, selectors and the asyncio
:class:`Producer` that ties them together."""
