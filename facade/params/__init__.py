"""Parameters: flat buffers, the gather after a step (stages 1-2), sharded parameters (stage 3),
module buffers."""
