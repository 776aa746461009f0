from aioserve.cli import main

main()
