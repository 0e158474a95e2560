"""What a worker is doing while it loads, for the driver to say: a Ray actor answers no call until its
constructor returns, so each worker writes its stage (starting, fetching the models, loading them, measuring
goodput's costs) under its own key in Ray's key-value store (the GCS's), and the driver reads the keys of its
pool. Outside Ray, or where the store cannot be reached, nothing is written and nothing read: a stage is
information, never a worker's failure.
"""

from __future__ import annotations

import json
import os
import socket
import time

NAMESPACE = "specbatch-loading"


class Stages:
    """A worker's stages under `key` (None: not told to anyone), each with the seconds since its process started."""

    def __init__(self, key: str | None):
        import psutil

        self.key, self.t0 = key, psutil.Process().create_time()

    def __call__(self, stage: str) -> None:
        if not self.key:
            return
        try:
            import ray
            from ray.experimental import internal_kv

            if not internal_kv._internal_kv_initialized():
                return
            value = {"stage": stage, "elapsed_s": time.time() - self.t0, "node": ray.util.get_node_ip_address(),
                     "name": f"{socket.gethostname()}:{os.getpid()}"}
            internal_kv._internal_kv_put(self.key, json.dumps(value), namespace=NAMESPACE)
        except Exception:
            pass


def read(prefix: str) -> dict[str, dict] | None:
    """The stages written under keys starting with `prefix`, by key ({} where there are none; None where the store
    could not be read: nothing is known then, not that no worker was placed)."""
    try:
        from ray.experimental import internal_kv

        out = {}
        for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
            value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            if value:
                out[key.decode()] = json.loads(value)
        return out
    except Exception:
        return None


def clear(prefix: str) -> None:
    """Remove the stages written under `prefix`."""
    try:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(prefix, del_by_prefix=True, namespace=NAMESPACE)
    except Exception:
        pass
