"""Pure plans of a refit: rank mapping, bucket and shard plans, box geometry, target layouts."""
