"""`make backup` and `make restore` (`python -m scripts.backup`): the compose stack's databases and volumes."""
