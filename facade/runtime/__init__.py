"""The optimizer and its step: construction, domains, the step's phases, gradient reduction, and every
collective of a step (``collectives``)."""
