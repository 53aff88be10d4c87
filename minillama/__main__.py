from minillama.app.cli import main

main()
