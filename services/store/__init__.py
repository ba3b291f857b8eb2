"""The cluster KV store's client (:mod:`kvmesh.services.store.client`), the node side of a lent
segment (:mod:`kvmesh.services.store.segment`) and a model-less node that only lends memory to
the store (:mod:`kvmesh.services.store.node`)."""
