"""The bytes a cache's K/V tensors occupy, found from the cache's own attributes.

Independent of :func:`ced_csa2.runtime.shared_kv.cache_bytes` (which the tests check against it):
every tensor an entry is kept in -- ordinary layers' ``keys``/``values``, FP4 layers' and the
shared store's buffers (reached from the source and from every target alike), a sparse store's
indexer-key buffers and the targets' kept tables -- and the ``untyped_storage().nbytes()`` of each
distinct storage behind them, counted once.
"""

from transformers.cache_utils import DynamicLayer

from ced_csa2.runtime.shared_kv import BlockLayer, SharedLayer


def kv_tensors(cache):
    """Every tensor of ``cache`` that holds K/V entries (a storage may stand behind several)."""
    for layer in cache.layers:
        if isinstance(layer, SharedLayer):
            store = layer.store
            for tokens in (store.k, store.v, getattr(store, "index_keys", None)):
                if tokens is not None:
                    yield from tokens._buffers
            kept = getattr(store, "adapted", None)
            if kept is not None:
                yield from (*kept.k.values(), *kept.v.values())
        elif isinstance(layer, BlockLayer):
            yield from (*layer.k_store._buffers, *layer.v_store._buffers)
        elif isinstance(layer, DynamicLayer) and layer.is_initialized:
            yield from (layer.keys, layer.values)


def storage_sizes(cache) -> int:
    """Bytes of the distinct storages behind :func:`kv_tensors`, each counted once."""
    sizes = {}
    for t in kv_tensors(cache):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())
