"""What crosses the wire: typed control messages and metadata, integrity hashes, signatures."""
