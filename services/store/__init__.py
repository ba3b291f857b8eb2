"""The cluster KV store's client (:mod:`services.store.client`), the node side of a lent
segment (:mod:`services.store.segment`) and a model-less node that only lends memory to
the store (:mod:`services.store.node`)."""
