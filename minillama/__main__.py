from minillama.cli import main

main()
