"""How a step's lazy graph is handed to MLX (``runtime.mlx.launcher``), named without
loading MLX, for the command line's choices."""

# "inline": encoded on the thread that builds the step; "thread": on a thread of its own,
# while the building thread goes on to the next step.
LAUNCH_MODES = ("inline", "thread")
