from serving.enginesim.server import main

main()
