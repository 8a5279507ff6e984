#!/bin/sh
# A non-Python worker for --no-python: prints what the launcher told it.
echo "shell rank $RANK of $WORLD_SIZE local $LOCAL_RANK args $*"
