"""The models on this machine and how they get here: catalog.py lists them (`mlx-prefix ls`
and `rm`), pull.py downloads one into the Hugging Face cache (`mlx-prefix pull`)."""
