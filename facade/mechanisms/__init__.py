"""The facade's mechanisms: collectives, wire codec, process groups, dtypes, dynamo guards, streams.

The lowest layer of the facade ([Note: facade layers] in ``zeroplan.facade``): it imports
nothing else of the facade; ``params``, ``state`` and the step build on it.
"""
