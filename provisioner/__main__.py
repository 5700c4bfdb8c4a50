from provisioner.cli.main import main

main()
