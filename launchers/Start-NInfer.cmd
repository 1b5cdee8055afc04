@echo off
rem Start NInfer inside WSL: the server gets settings that fit the GPU, the chat opens in the
rem browser, the addresses other devices can use are printed, and closing this window stops it.
rem
rem   Start-NInfer.cmd [-Context N] [-Concurrency N] [-DraftTokens N] [-Weights FMT] [-Model PATH]
rem                    [-Port N] [-Share] [-LocalOnly] [-NoBrowser] [-Print] [-Distribution NAME]
rem
rem The logic lives in Python inside WSL (app/console.py, app/_windows.py). This file only finds
rem the distribution and the checkout, then runs launchers/serve.sh --windows there. The server is
rem stopped through its pid files (serve.sh --stop), never by process name.
setlocal EnableExtensions EnableDelayedExpansion
set "NINFER_DISTRO="
set "NINFER_DIR="

rem 1. installed by installers\install-windows.ps1: ninfer-wsl.cfg (DISTRO=..., DIR=...) beside this file
if exist "%~dp0ninfer-wsl.cfg" (
    for /f "usebackq eol=# tokens=1,* delims==" %%a in ("%~dp0ninfer-wsl.cfg") do set "NINFER_%%a=%%b"
)
rem 2. started from the checkout inside WSL: \\wsl.localhost\DISTRO\path\launchers\ or \\wsl$\DISTRO\...
if not defined NINFER_DIR (
    for /f "tokens=1,2,* delims=\" %%a in ("%~dp0") do (
        if /i "%%a"=="wsl.localhost" (set "NINFER_DISTRO=%%b" & set "NINFER_DIR=/%%c..")
        if /i "%%a"=="wsl$" (set "NINFER_DISTRO=%%b" & set "NINFER_DIR=/%%c..")
    )
)
if not defined NINFER_DIR (
    echo NInfer: cannot find the NInfer folder inside WSL.
    echo Run installers\install-windows.ps1, or start this file from the checkout in WSL
    echo ^(\\wsl.localhost\DISTRIBUTION\home\you\ninfer\launchers\Start-NInfer.cmd^).
    exit /b 1
)
set "NINFER_DIR=!NINFER_DIR:\=/!"

rem parameters: -Distribution is ours, the rest goes to the launcher in WSL
set "NINFER_ARGS="
:parse
if "%~1"=="" goto parsed
if /i "%~1"=="-Distribution" (
    set "NINFER_DISTRO=%~2"
    shift & shift
    goto parse
)
set NINFER_ARGS=!NINFER_ARGS! "%~1"
shift
goto parse
:parsed

set "NINFER_WSL=wsl.exe"
if defined NINFER_DISTRO set "NINFER_WSL=wsl.exe -d !NINFER_DISTRO!"
title NInfer
!NINFER_WSL! --cd "!NINFER_DIR!" -- ./launchers/serve.sh --windows!NINFER_ARGS!
set "NINFER_RC=!ERRORLEVEL!"
rem Ctrl+C ends wsl.exe first: make sure the launcher and its server are gone
!NINFER_WSL! --cd "!NINFER_DIR!" -- ./launchers/serve.sh --stop >nul 2>&1
exit /b !NINFER_RC!
