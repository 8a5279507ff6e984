"""``distcomm.elastic``: the parts of ``torch.distributed.elastic`` that training scripts import."""
