from memprof.cli.app import main

main()
