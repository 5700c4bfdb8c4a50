from provisioner.entry import main

main()
