from fsdp2gen.cli import main

main()
