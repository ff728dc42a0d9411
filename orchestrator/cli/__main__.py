from rollcall.orchestrator.cli import main

main()
