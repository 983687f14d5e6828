from vidtune.cli import main

raise SystemExit(main())
