"""Images in the prompt (issue 42): intake, cache key, positions, towers, forward.

The modules, in the order an image travels:
  intake.py     bytes -> an EncodedImage under limits (format read from the bytes, pixel
                count from the header), a request's images checked whole before the first
                decode, its pixel digest; decoded pixels never kept; ImageInput (an image
                and its detail; each API family's parts read into it: server/protocol/images.py)
  fetch.py      http(s) image URLs: refused, or (--allow-image-urls) fetched from public
                addresses only, pinned to the checked address, size and time bounded
  family.py     what every family shares (VisionFamily, PreparedImage, ChunkInputs) and
                the tower builders: mlx-vlm's classes on the folder's vision_tower.* weights
  tower.py      which family serves a checkpoint (FAMILIES, by model type, imported on
                use), whether its files hold a tower; the text stays mlx-lm's
  prepared.py   prepared images (the tower's input) between requests, in a byte cap
  qwen.py       Qwen3.5 (qwen3_5, qwen3_5_moe): processor, tower, M-RoPE
  gemma.py      Gemma 3: SigLIP tower + projector, bidirectional attention over an image
  key.py        an image's key (pixels + processing + grid); its span salted in the trie key
  positions.py  the whole prompt's rotary positions (M-RoPE) on every request
  rope.py       mlx-lm's attention RoPE taking those positions per forward
  features.py   the vision-feature cache: an image's tower output by key, in a byte budget
  forward.py    one prefill chunk with images: ids, embeddings, positions, the model
  testing.py    tiny random-weight vision model folders (tests, benchmarks)
Nothing here is imported by a text-only server: mlx-vlm loads only for a vision model.
"""
