"""Records to the collector: the shipper thread, its HTTP transport, the node relay, OTLP."""
