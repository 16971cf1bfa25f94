"""What a user runs: `generate` (batched generation and the paged vs
contiguous comparison), `openai.api_server` (the OpenAI-compatible server),
`workload` (the workloads both serve)."""
