"""Env hosts on a Ray cluster (``workers=ray``, extra ``ray``): the cluster, the host actor, the driver's collector."""
