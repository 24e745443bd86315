"""Pure-torch algorithm math (no verl import): losses, advantages, importance weights."""
