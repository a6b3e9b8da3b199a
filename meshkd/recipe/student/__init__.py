"""The student's side: each step's micro-batches paired with the teacher's answers, the optimizer step
and its loss terms, held-out evaluation, on-policy samples, and the layers a pruned student keeps."""
