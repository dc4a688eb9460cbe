"""transport: chunked, verified point-to-point transfer of a committed step over gloo (send, receive, bounded send, wire format)."""
