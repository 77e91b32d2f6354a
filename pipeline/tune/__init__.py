"""Ray Tune: algorithms as Trainables, and ``runnel train`` trials through Tune."""
