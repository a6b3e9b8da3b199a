"""The training rows: data files and Hugging Face datasets read into documents, tokenized (or read from a
token store), NEAT-packed and batched per data-parallel rank; rows aligned with a second tokenizer
or routed to one of several teachers."""
