from megatron_fastpath.train import main

main()
