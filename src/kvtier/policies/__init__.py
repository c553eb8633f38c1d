"""Cache (eviction) policies: the `CachePolicy` strategy, its registry and the built-ins."""

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import (
    CachePolicy,
    get_policy_cls,
    make_policy,
    register_policy,
    registered_policies,
)
from kvtier.policies.kvaware import KVAwarePolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy
from kvtier.policies.sieve import SIEVEPolicy

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "KVAwarePolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "get_policy_cls",
    "make_policy",
    "register_policy",
    "registered_policies",
]
