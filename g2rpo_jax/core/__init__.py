"""What every layer stands on: local and gs:// paths (storage.py) and the float promotion of the
sampling and RL math (dtypes.py). Imports nothing else of the package."""
