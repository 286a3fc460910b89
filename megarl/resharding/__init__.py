"""Resharding: Megatron training shards (TP/PP/EP/ETP/VPP) -> rollout engine weights.

metadata.py describes what each rank holds, plan.py turns that into a pure, cached plan of
buckets, transport.py moves a bucket's pieces, sync.py is the one public call: sync_weights.
"""

from megarl.resharding.sync import SyncReport, sync_weights

__all__ = ["SyncReport", "sync_weights"]
