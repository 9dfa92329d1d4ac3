"""Building blocks of the collector graph and the trainers (no Hydra imports).

Kept empty on purpose: env worker processes import ``components.*`` modules
and must not pull in torch or tensordict through this package.
"""
