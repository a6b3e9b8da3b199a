"""The torch-only library: topology, transport between the roles, teacher-logits encodings and losses."""
