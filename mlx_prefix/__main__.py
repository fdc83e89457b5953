from mlx_prefix.launcher import main

main()
