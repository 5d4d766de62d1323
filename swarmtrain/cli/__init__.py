"""The ``swarmtrain`` command."""
