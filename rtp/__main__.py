from rtp.cli import main

raise SystemExit(main())
