"""Engine events -> each API family's reply. The assembler turns token events into deltas
(reasoning, text, tool calls, logprobs: assembler.py, tools.py); stream.py pumps one
request's events into an SSE stream (sse.py frames it) or collects them for one JSON body;
one writer per family shapes both forms: chat.py (chat and completions), anthropic.py,
responses.py, embeddings.py."""
