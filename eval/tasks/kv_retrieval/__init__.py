"""Key-value retrieval (InfiniteBench / SCBench style): UUID pairs in a JSON object, generated in
the model's own tokenizer, several keys asked about one object, one sample per key. The task
(`task`) and its report (`report`)."""
