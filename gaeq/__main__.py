from gaeq.cli import main

main()
