from colocate_rl.cli import main

main()
