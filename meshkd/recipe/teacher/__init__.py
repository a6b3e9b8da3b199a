"""The teacher's side: its answers as types (made by the teacher, read by the student), paired layers'
hidden states, the worker that answers requests, and the cache of its answers."""
