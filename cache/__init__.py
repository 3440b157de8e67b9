"""The cache service: exact tier now, semantic tier on Milvus behind the same store API."""
