"""Running the user's script in this process as ``python`` would, and every way it may end."""
