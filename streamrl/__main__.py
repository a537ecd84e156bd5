from streamrl.cli import main

main()
