"""The building blocks the decoder (:mod:`ember.models.decoder`) composes: attention
over the paged KV, rotary embeddings, RMSNorm and the gated MLP."""
