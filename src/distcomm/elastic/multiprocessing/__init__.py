"""``distcomm.elastic.multiprocessing``: see ``errors`` (``record``)."""
