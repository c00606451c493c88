"""IDs themselves: how the 63 bits are divided (:mod:`.layout`), their text forms (:mod:`.encodings`)
and the tools that read and compute them without a daemon (:mod:`.tools`)."""
