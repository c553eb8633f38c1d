"""Cache (eviction) policies: the `CachePolicy` strategy, its registry and the built-ins."""

from kvtier.policies.base import (
    CachePolicy,
    get_policy_cls,
    make_policy,
    register_policy,
    registered_policies,
)
from kvtier.policies.lru import LRUPolicy

__all__ = [
    "CachePolicy",
    "LRUPolicy",
    "get_policy_cls",
    "make_policy",
    "register_policy",
    "registered_policies",
]
